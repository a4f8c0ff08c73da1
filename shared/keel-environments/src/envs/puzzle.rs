//! `sliding_puzzle`: the N×N sliding-tile game, the reference multi-turn environment.
//!
//! The board is N×N tiles numbered 1..N²−1 and one blank; it is solved when the tiles read
//! 1, 2, ... row by row with the blank last. A new game comes from `metadata`
//! `{"size", "seed", "shuffle_moves"}` (the solved board shuffled by that many random legal
//! moves, so the same metadata always gives the same game); a game in progress carries its
//! `board` (rows of numbers, 0 for the blank) and `moves` in the metadata each step returns.
//!
//! Actions, the last `<action>…</action>` of the model's turn: `up`, `down`, `left`, `right`
//! move the tile next to the blank in that direction into it (`up` moves the tile below the
//! blank up), `slide R C` slides the tile at row R, column C (1-based) into the blank next to
//! it, `view` shows the board. Every step answers the board; an invalid action is explained
//! and the game goes on. Reward 1 when solved; the episode also ends after `max_moves`.

use keel_protocol::FieldError;
use keel_protocol::reward::{EnvSample, EnvStepResult, Message, SampleError, SlidingPuzzleConfig};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::envs::{Outcome, SampleEnv, last_turn};

/// The stop string of every turn.
pub const STOP: &str = "</action>";

const MAX_SIZE: usize = 8;

/// A board: row-major tiles, 0 = blank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Board {
    size: usize,
    tiles: Vec<u32>,
}

/// A move of a tile into the blank, by the direction the tile travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Up,
    Down,
    Left,
    Right,
}

impl Direction {
    pub const ALL: [Direction; 4] = [Self::Up, Self::Down, Self::Left, Self::Right];

    pub fn name(self) -> &'static str {
        match self {
            Self::Up => "up",
            Self::Down => "down",
            Self::Left => "left",
            Self::Right => "right",
        }
    }

    pub fn opposite(self) -> Self {
        match self {
            Self::Up => Self::Down,
            Self::Down => Self::Up,
            Self::Left => Self::Right,
            Self::Right => Self::Left,
        }
    }
}

impl Board {
    pub fn solved(size: usize) -> Self {
        let cells = size * size;
        let tiles = (1..cells as u32).chain(std::iter::once(0)).collect();
        Self { size, tiles }
    }

    /// The solved board shuffled by `moves` random legal moves (never undoing the last one).
    /// Returns the board and the moves made.
    pub fn shuffled(size: usize, seed: u64, moves: usize) -> (Self, Vec<Direction>) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut board = Self::solved(size);
        let mut made: Vec<Direction> = Vec::with_capacity(moves);
        while made.len() < moves {
            let legal: Vec<Direction> = Direction::ALL
                .into_iter()
                .filter(|d| board.source(*d).is_some() && made.last().is_none_or(|last| last.opposite() != *d))
                .collect();
            let pick = legal[rng.random_range(0..legal.len())];
            board.apply(pick);
            made.push(pick);
        }
        (board, made)
    }

    pub fn is_solved(&self) -> bool {
        *self == Self::solved(self.size)
    }

    fn blank(&self) -> (usize, usize) {
        let at = self.tiles.iter().position(|t| *t == 0).unwrap_or(0);
        (at / self.size, at % self.size)
    }

    /// The cell whose tile would move into the blank in direction `d`.
    fn source(&self, d: Direction) -> Option<(usize, usize)> {
        let (r, c) = self.blank();
        let n = self.size;
        match d {
            Direction::Up => (r + 1 < n).then(|| (r + 1, c)),
            Direction::Down => r.checked_sub(1).map(|r| (r, c)),
            Direction::Left => (c + 1 < n).then(|| (r, c + 1)),
            Direction::Right => c.checked_sub(1).map(|c| (r, c)),
        }
    }

    /// Moves a tile in direction `d`; false when no tile can.
    pub fn apply(&mut self, d: Direction) -> bool {
        match self.source(d) {
            Some(cell) => {
                self.swap_with_blank(cell);
                true
            }
            None => false,
        }
    }

    /// Slides the tile at `(row, col)` (0-based) into the blank.
    fn slide(&mut self, row: usize, col: usize) -> Result<(), Invalid> {
        let n = self.size;
        if row >= n || col >= n {
            return Err(Invalid(format!("there is no cell at row {}, column {} on a {n}×{n} board", row + 1, col + 1)));
        }
        let (br, bc) = self.blank();
        if br.abs_diff(row) + bc.abs_diff(col) != 1 {
            return Err(Invalid(format!("the tile at row {}, column {} is not next to the blank", row + 1, col + 1)));
        }
        self.swap_with_blank((row, col));
        Ok(())
    }

    fn swap_with_blank(&mut self, (row, col): (usize, usize)) {
        let (br, bc) = self.blank();
        self.tiles.swap(br * self.size + bc, row * self.size + col);
    }

    /// Rows of numbers with `_` for the blank.
    pub fn render(&self) -> String {
        let width = (self.size * self.size - 1).to_string().len();
        self.tiles
            .chunks(self.size)
            .map(|row| {
                row.iter()
                    .map(|t| if *t == 0 { format!("{:>width$}", "_") } else { format!("{t:>width$}") })
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn to_json(&self) -> Value {
        Value::Array(self.tiles.chunks(self.size).map(|row| json!(row)).collect())
    }

    /// A board from rows of numbers; every tile 0..N²−1 exactly once.
    pub fn from_json(value: &Value) -> Result<Self, FieldError> {
        let rows: Vec<Vec<u32>> = serde_json::from_value(value.clone())
            .map_err(|e| FieldError::new("metadata.board", format!("rows of numbers expected: {e}")))?;
        let size = rows.len();
        if !(2..=MAX_SIZE).contains(&size) || rows.iter().any(|r| r.len() != size) {
            return Err(FieldError::new("metadata.board", format!("must be square, 2 to {MAX_SIZE} rows")));
        }
        let tiles: Vec<u32> = rows.into_iter().flatten().collect();
        let mut sorted = tiles.clone();
        sorted.sort_unstable();
        if sorted.iter().enumerate().any(|(i, t)| *t as usize != i) {
            return Err(FieldError::new("metadata.board", format!("must hold each of 0..{} once", size * size - 1)));
        }
        Ok(Self { size, tiles })
    }
}

/// The board a sample's metadata describes.
pub fn board_of(metadata: &Value) -> Result<Board, FieldError> {
    if let Some(board) = metadata.get("board") {
        return Board::from_json(board);
    }
    let number = |key: &str, default: u64| match metadata.get(key) {
        None => Ok(default),
        Some(v) => {
            v.as_u64().ok_or_else(|| FieldError::new(format!("metadata.{key}"), "must be a non-negative integer"))
        }
    };
    let size = number("size", 3)? as usize;
    if !(2..=MAX_SIZE).contains(&size) {
        return Err(FieldError::new("metadata.size", format!("must be 2 to {MAX_SIZE}")));
    }
    let shuffle = number("shuffle_moves", 20)?.min(10_000) as usize;
    Ok(Board::shuffled(size, number("seed", 0)?, shuffle).0)
}

enum Action {
    Move(Direction),
    Slide(usize, usize),
    View,
}

/// An action the game cannot take; the text is what the model is told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
struct Invalid(String);

fn parse_action(response: &str) -> Result<Action, Invalid> {
    let start = response.rfind("<action>").ok_or_else(|| Invalid("no <action>…</action> found".into()))?;
    let rest = &response[start + "<action>".len()..];
    let body = rest.split(STOP).next().unwrap_or(rest).trim().to_lowercase();
    let words: Vec<&str> = body.split_whitespace().collect();
    match words.as_slice() {
        ["view"] => Ok(Action::View),
        [word] => Direction::ALL
            .into_iter()
            .find(|d| d.name() == *word)
            .map(Action::Move)
            .ok_or_else(|| Invalid(format!("unknown action `{body}`"))),
        ["slide", r, c] => match (r.parse::<usize>(), c.parse::<usize>()) {
            (Ok(r), Ok(c)) if r >= 1 && c >= 1 => Ok(Action::Slide(r - 1, c - 1)),
            _ => Err(Invalid(format!("`slide` takes a row and a column from 1: `{body}`"))),
        },
        _ => Err(Invalid(format!("unknown action `{body}`"))),
    }
}

#[derive(Debug)]
pub struct PuzzleEnv {
    max_moves: u32,
}

impl PuzzleEnv {
    pub fn new(config: &SlidingPuzzleConfig) -> Result<Self, FieldError> {
        if config.max_moves == 0 {
            return Err(FieldError::new("max_moves", "must be at least 1"));
        }
        Ok(Self { max_moves: config.max_moves })
    }
}

impl SampleEnv for PuzzleEnv {
    fn step_one(&self, sample: &EnvSample) -> Outcome {
        let response = last_turn(sample)?;
        let mut board = board_of(&sample.metadata).map_err(|e| SampleError::new("invalid_sample", e.to_string()))?;
        let moves = sample.metadata.get("moves").and_then(Value::as_u64).unwrap_or(0) + 1;
        let note = match parse_action(response) {
            Ok(Action::View) => Ok("Here is the board.".to_string()),
            Ok(Action::Move(d)) => {
                if board.apply(d) {
                    Ok(format!("Moved a tile {}.", d.name()))
                } else {
                    Err(Invalid(format!("no tile can move {}", d.name())))
                }
            }
            Ok(Action::Slide(r, c)) => board.slide(r, c).map(|()| format!("Slid the tile at {} {}.", r + 1, c + 1)),
            Err(e) => Err(e),
        };
        let solved = board.is_solved();
        let out_of_moves = moves >= u64::from(self.max_moves);
        let text = match (&note, solved) {
            (_, true) => format!("{}\nSolved!\n{}", note.as_deref().unwrap_or(""), board.render()),
            (Ok(n), false) => format!("{n}\n{}", board.render()),
            (Err(e), false) => format!(
                "Invalid action: {e}. Use <action>up|down|left|right|view</action> or <action>slide R C</action>.\n{}",
                board.render()
            ),
        };
        let mut metadata = match &sample.metadata {
            Value::Object(map) => map.clone(),
            _ => serde_json::Map::new(),
        };
        metadata.insert("board".into(), board.to_json());
        metadata.insert("moves".into(), json!(moves));
        let mut result = EnvStepResult::done(f64::from(u8::from(solved)), Value::Object(metadata));
        result.terminated = solved || out_of_moves;
        result.observation = Some(Message::new("user", text));
        result.stop_strings = Some(vec![STOP.to_string()]);
        result.info = json!({"valid_action": note.is_ok(), "solved": solved, "moves": moves});
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(env: &PuzzleEnv, metadata: &Value, response: &str) -> EnvStepResult {
        let sample = EnvSample {
            messages: vec![Message::new("user", "solve"), Message::new("assistant", response)],
            metadata: metadata.clone(),
            token_ids: None,
            agent: None,
        };
        env.step_one(&sample).unwrap()
    }

    #[test]
    fn scripted_solutions_solve() {
        let env = PuzzleEnv::new(&SlidingPuzzleConfig { max_moves: 100 }).unwrap();
        for (size, seed, shuffles) in [(2, 1, 3), (3, 7, 12), (4, 42, 25)] {
            let metadata = json!({"size": size, "seed": seed, "shuffle_moves": shuffles});
            let (start, made) = Board::shuffled(size, seed, shuffles);
            assert!(!start.is_solved() || shuffles == 0);
            assert_eq!(board_of(&metadata).unwrap(), start, "the same metadata gives the same game");
            let mut state = metadata;
            let solution: Vec<Direction> = made.iter().rev().map(|d| d.opposite()).collect();
            for (i, d) in solution.iter().enumerate() {
                let result = step(&env, &state, &format!("I will move <action>{}</action>", d.name()));
                let last = i + 1 == solution.len();
                assert_eq!((result.terminated, result.reward), (last, if last { 1.0 } else { 0.0 }), "move {i}");
                assert_eq!(result.stop_strings.as_deref(), Some(&[STOP.to_string()][..]));
                state = result.metadata;
            }
            assert_eq!(Board::from_json(&state["board"]).unwrap(), Board::solved(size));
        }
    }

    #[test]
    fn slide_by_position_and_rendering() {
        let env = PuzzleEnv::new(&SlidingPuzzleConfig::default()).unwrap();
        let metadata = json!({"board": [[1, 2, 3], [4, 5, 6], [7, 0, 8]]});
        let result = step(&env, &metadata, "<action>view</action>");
        let text = result.observation.unwrap().content;
        assert!(text.contains("1 2 3\n4 5 6\n7 _ 8"), "{text}");
        assert!(!result.terminated);
        let result = step(&env, &metadata, "<action>slide 3 3</action>");
        assert_eq!((result.reward, result.terminated), (1.0, true));
        assert!(result.observation.unwrap().content.contains("Solved"));
        let result = step(&env, &json!({"board": [[1, 2], [0, 3]]}), "<action>left</action>");
        assert_eq!(result.reward, 1.0);
    }

    #[test]
    fn invalid_actions_are_explained_and_the_game_goes_on() {
        let env = PuzzleEnv::new(&SlidingPuzzleConfig { max_moves: 3 }).unwrap();
        let metadata = json!({"board": [[1, 2, 3], [4, 5, 6], [7, 0, 8]]});
        let cases = [
            ("no tags at all", "no <action>"),
            ("<action>fly</action>", "unknown action `fly`"),
            ("<action>up</action>", "no tile can move up"),
            ("<action>slide 1 1</action>", "not next to the blank"),
            ("<action>slide 9 9</action>", "no cell at row 9"),
            ("<action>slide 0 x</action>", "`slide` takes"),
        ];
        for (response, needle) in cases {
            let result = step(&env, &metadata, response);
            let text = result.observation.unwrap().content;
            assert!(text.contains("Invalid action") && text.contains(needle), "{response}: {text}");
            assert_eq!(result.metadata["board"], metadata["board"], "an invalid action changes nothing");
            assert_eq!(result.info["valid_action"], false);
        }
        let mut state = metadata;
        let mut ended = Vec::new();
        for _ in 0..3 {
            let result = step(&env, &state, "<action>view</action>");
            ended.push(result.terminated);
            state = result.metadata;
        }
        assert_eq!(ended, [false, false, true], "the episode ends after max_moves");
        let bad = json!({"board": [[1, 1], [0, 3]]});
        let sample = EnvSample {
            messages: vec![Message::new("assistant", "<action>up</action>")],
            metadata: bad,
            token_ids: None,
            agent: None,
        };
        assert!(env.step_one(&sample).unwrap_err().message.contains("metadata.board"));
    }
}
